"""`kvstore` command line (typer + rich). Talks to services only through their HTTP APIs,
except `up`, `directory serve` and `worker serve`, which run them."""
