"""Names and message formats every side agrees on: headers, queues, settings, inbound checks."""
