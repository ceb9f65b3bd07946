"""Backend adapters, one module each; imported lazily through mla_dispatch.dispatch.registry."""
