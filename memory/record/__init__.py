"""The conversation record: conversations, branches, turns, imports, and the persistence of a reply's life."""
