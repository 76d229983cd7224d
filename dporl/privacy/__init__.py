"""The privacy layer: every noise draw and every epsilon dporl reports is computed here."""

# The private-selection analysis registers its Renyi curve with dporl.privacy.rdp on import.
from dporl.privacy import selection as _selection  # noqa: E402,F401
