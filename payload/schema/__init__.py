"""The documents stages exchange, as dataclasses: a job and a shard set's manifest."""
