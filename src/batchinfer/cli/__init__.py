"""Command line: `batchinfer serve | generate | embed | bench`. Each subcommand lives in its own
module exposing `register(subparsers)`; `main` wires them together."""
