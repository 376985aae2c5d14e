"""The generative scheduler and its rules, one module per rule (docs/scheduling.md, "Where
each rule lives"). Import from the modules: this file imports nothing, so `core.config` can
read the policy names without a circle."""
