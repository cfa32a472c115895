"""AdamW as every engine builds it, replicated or sharded inside a datacenter."""
