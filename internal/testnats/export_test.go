package testnats

// Dir is the server's directory, for the test that it is removed.
func Dir(s *Server) string { return s.dir }
