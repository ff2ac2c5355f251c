"""vLLM glue for kittens. Imported only inside vLLM processes (the plugin entry point)."""

KITTENS = "kittens"  # the --moe-backend value
