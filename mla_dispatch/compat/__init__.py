"""Drop-in replacements for other libraries' APIs, implemented on mla_dispatch."""
