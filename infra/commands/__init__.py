"""The commands besides `pulumi up`: plan, smoke and offline (the program under Pulumi's mocks)."""
