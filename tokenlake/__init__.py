"""TokenLake."""
