package testdb

import (
	"bytes"
	"sync"
)

// Buffer is a bytes.Buffer safe for concurrent writers: a logger, a
// daemon's output, a child process's stderr read while it runs.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *Buffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *Buffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
