"""The `radixlm` command: `radixlm generate PROMPT` (and, with the server, `radixlm serve`)."""

from __future__ import annotations

import argparse
import sys


def _generate(argv: list[str]) -> int:
    from radixlm.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="radixlm generate", description="Generate a reply to one prompt.")
    parser.add_argument("prompt", help="the user message (sent through the model's chat template)")
    parser.add_argument("--raw", action="store_true", help="complete the prompt as plain text, no chat template")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    from radixlm.srt.entrypoints.engine import Engine
    from radixlm.srt.errors import RadixLMError

    server_args = ServerArgs.from_cli_args(args)
    kwargs = {k: v for k, v in vars(server_args).items() if k != "model_path"}
    engine = Engine(server_args.model_path, **kwargs)
    params = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
    }
    try:
        if args.raw:
            stream = engine.generate(args.prompt, params, stream=True)
        else:
            stream = engine.chat([{"role": "user", "content": args.prompt}], params, stream=True)
        shown = 0
        for chunk in stream:
            sys.stdout.write(chunk["text"][shown:])
            sys.stdout.flush()
            shown = len(chunk["text"])
        sys.stdout.write("\n")
    except RadixLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _serve(argv: list[str]) -> int:
    from radixlm.srt.entrypoints.launch import main as serve_main

    serve_main(argv)
    return 0


def _router(argv: list[str]) -> int:
    from radixlm.srt.router.launch import main as router_main

    router_main(argv)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"generate": _generate, "serve": _serve, "router": _router}
    if not argv or argv[0] not in commands:
        print(
            "usage: radixlm {serve,router,generate} ...\n"
            "  serve             start the OpenAI-compatible HTTP server (see `radixlm serve --help`)\n"
            "  router            one endpoint over many servers (see `radixlm router --help`)\n"
            "  generate PROMPT   answer one prompt (default model: the embedded SmolLM2-135M-Instruct)",
            file=sys.stderr,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
