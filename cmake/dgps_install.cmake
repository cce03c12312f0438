# Install rules: not yet.
