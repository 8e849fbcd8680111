"""Tools apart from the server and the client: local launcher, top, network namespaces, benchmarks, advise."""
