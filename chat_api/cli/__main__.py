"""`python -m chat_api.cli`: the `chatmem` command without the console script on PATH."""

from chat_api.cli.main import main

main()
