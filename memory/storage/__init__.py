"""Where rows live: the database, the schema and its migrations, tenancy, retention."""
