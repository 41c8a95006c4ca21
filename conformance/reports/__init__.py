"""What a run writes: report.json / report.md, the terminal tables, junit.xml, the report folder."""
