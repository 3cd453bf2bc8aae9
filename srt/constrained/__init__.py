"""Grammar-constrained decoding: JSON schema, regex, EBNF and choice lists compiled into token masks.

`base` is the interface, `outlines_backend` / `xgrammar_backend` the engines, `manager` compiles off the
scheduler loop (worker pool, cache, timeouts), `spec` validates what users send, `bitmask` applies masks."""
