package idem

// The error conversion, for the external tests that need a real server
// (package testdb imports idem, so they cannot be internal tests).
var (
	ConvertForTest   = convert
	TransientForTest = transient
)
