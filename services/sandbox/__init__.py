"""sandbox: runs jobs from SANDBOX in isolation and replies with the result."""
