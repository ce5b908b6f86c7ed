package inbox_test

const childEnv = "INBOX_TEST_CHILD"

func child() int { return 0 }
