"""Placement: which queued job runs next, on which nodes (see service.scheduling.placement)."""
