"""deltaps: the shared kernel (errors, config, layout, units, wire, transport, security), the command line and the tools."""
