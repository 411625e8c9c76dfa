"""The course's tooling that no notebook imports: the editions (tools/editions.py)."""
