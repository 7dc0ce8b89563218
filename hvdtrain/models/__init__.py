"""Model families. Each is its own module with one ``build_*`` function; entry points pick one."""
