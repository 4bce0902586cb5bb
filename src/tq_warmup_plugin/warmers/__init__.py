"""Built-in warmers: TurboQuant key contributions and the Triton compiler."""
