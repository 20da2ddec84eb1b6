"""Plumbing: errors, storage (local or gs://), status, lease, host, TFRecords, events."""
