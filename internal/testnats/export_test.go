package testnats

// Dir is the server's directory, for the test that it is removed.
func Dir(s *Server) string { return s.dir }

// SetBinaries replaces where Binary looks, until the test ends.
func SetBinaries(t interface{ Cleanup(func()) }, paths ...string) {
	old := binaries
	binaries = paths
	t.Cleanup(func() { binaries = old })
}
