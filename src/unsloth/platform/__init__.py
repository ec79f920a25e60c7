"""Platform detection: probes (effects) -> parsers (pure) -> detect (merge into Platform)."""
