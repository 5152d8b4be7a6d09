"""Pure packing algorithms: numpy only, never torch, ranks or files."""
