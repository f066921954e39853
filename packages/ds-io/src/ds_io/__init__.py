"""ds-io."""
