"""Command-line glue of the stage modules that are not packages: argv -> config -> a call into the layer below."""
