"""The `torchyard` command: one entry point that dispatches to the service and the client."""
