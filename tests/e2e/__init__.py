"""The whole cluster path on one machine: emulated API, operator, pods as local processes."""
