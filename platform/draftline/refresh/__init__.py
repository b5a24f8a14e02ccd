"""`draftline refresh`: train the champion further on captured traffic (docs/refresh.md)."""
