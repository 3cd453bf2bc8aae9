"""The data-parallel router: one HTTP endpoint over many `radixlm serve` workers, sending each request where its
prompt's prefix is most likely cached (cache_aware) or by the load the workers report."""
