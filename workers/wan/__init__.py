"""The application-level WAN emulator: what an inter-DC collective costs and the shared link state that charges it."""
