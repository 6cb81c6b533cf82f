"""Long-term memory: what is remembered, and everything that finds it, from the query to the SQL."""
