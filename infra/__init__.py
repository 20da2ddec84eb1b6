"""The Pulumi program: one stack per `pulumi up`, from stacks/Pulumi.<stack>.yaml."""
