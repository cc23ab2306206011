"""The `blocktrain` command line: one module per subcommand, each parsing its arguments and
making one library call."""
