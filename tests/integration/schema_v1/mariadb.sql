-- The dedup table at schema version 1, as idemq 0.1.0 made it:
-- `idemq schema --dialect mariadb --no-outbox` at d1d3d96 (the table's shape is unchanged
-- since the store first shipped, da90bde).
CREATE TABLE message_idempotent (
	consumer VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL,
	message_id VARCHAR(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_nopad_bin NOT NULL,
	business_id VARCHAR(64),
	status SMALLINT NOT NULL DEFAULT 0,
	payload_hash VARCHAR(64),
	result MEDIUMTEXT,
	owner VARCHAR(32),
	lease_until_ms BIGINT,
	attempts INTEGER NOT NULL DEFAULT 1,
	processed_time DATETIME(6),
	created_time DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
	PRIMARY KEY (consumer, message_id)
);

CREATE INDEX ix_message_idempotent_status_time ON message_idempotent (status, processed_time);
