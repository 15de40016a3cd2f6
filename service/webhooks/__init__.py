"""Webhooks: endpoints an admin registers, and the signed delivery of every job state change to them."""
