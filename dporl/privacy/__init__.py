"""The privacy layer: every noise draw and every epsilon dporl reports is computed here."""
