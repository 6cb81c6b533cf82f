"""Accounts: API keys, and deleting a user."""
