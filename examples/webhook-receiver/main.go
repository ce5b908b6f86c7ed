// Command webhook-receiver serves the example Stripe receiver on $ADDR
// (default :8080), verifying deliveries with $STRIPE_WEBHOOK_SECRET (the
// endpoint's signing secret, "whsec_..."; several separated by commas
// while one is rolled).
//
//	DATABASE_URL=postgres://... STRIPE_WEBHOOK_SECRET=whsec_... go run ./examples/webhook-receiver
package main

import (
	"context"
	"log"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/webhook-receiver/receiver"
	"github.com/idemkit/idem/migrate"

	"github.com/jackc/pgx/v5/stdlib"
)

func main() {
	secrets := strings.Split(os.Getenv("STRIPE_WEBHOOK_SECRET"), ",")
	if secrets[0] == "" {
		log.Fatal("STRIPE_WEBHOOK_SECRET is not set: give the endpoint's signing secret (whsec_...) from the Stripe dashboard or `stripe listen`")
	}
	addr := os.Getenv("ADDR")
	if addr == "" {
		addr = ":8080"
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := migrate.Up(ctx, stdlib.OpenDBFromPool(pool)); err != nil {
		log.Fatal(err)
	}
	if err := receiver.Setup(ctx, pool); err != nil {
		log.Fatal(err)
	}
	rc := &receiver.Receiver{Pool: pool, Idem: idem.New(pool, nil), Mail: &receiver.StubMailer{}}
	h, err := rc.Handler(nil, secrets...)
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /webhooks/stripe", h)
	srv := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	log.Printf("listening on %s", srv.Addr)
	if err := srv.ListenAndServe(); err != nil && err != http.ErrServerClosed {
		log.Fatal(err)
	}
}
