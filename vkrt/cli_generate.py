"""generate / chat / bench / serve subcommands (placeholder until the engine lands)."""
