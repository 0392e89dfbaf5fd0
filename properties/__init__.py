"""properties."""
