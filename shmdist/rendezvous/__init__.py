"""Finding each other: init_method and key-value stores (store), host identity
and listen address (hosts), rank/size/master from launchers' environments (launchers)."""
