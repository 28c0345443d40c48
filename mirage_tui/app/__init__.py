"""The interactive console (Textual). Only ``mirage-tui`` without ``--batch`` imports this package."""
