"""The process and its operating system: memory, stop signals, the runtime file other processes find the daemon by,
and the sockets it listens on."""
