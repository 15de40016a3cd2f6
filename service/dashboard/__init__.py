"""The browser dashboard: a static single page served at `/` that reads the v1 API with the user's token."""
