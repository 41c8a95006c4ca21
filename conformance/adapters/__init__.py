"""The implementations under test: the adapters the suite knows by name, the defect-injecting one
built on the built-in, and the guard every adapter call goes through."""
