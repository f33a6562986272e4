"""Recipe schemas (names, versions, parameters, fields) and their text tables: pure data, no torch."""
