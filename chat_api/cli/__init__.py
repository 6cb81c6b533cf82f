"""The `chatmem` command, one module per group of subcommands.

- main.py          the parser and `main` (the console script); token, db, users, relay, indexer
- serve.py         up (everything on embedded defaults) and serve
- installation.py  what every command acts on: settings, the installation's secret, its
                   database, bearer credentials for the API, and the one-line CommandError
- keys.py, imports.py, mcp.py, local_model.py   keys, import, mcp (stdio), local-model
- settings_doc.py  the README's settings table (`make docs`)
"""
